"""How the engine is built: its settings and flags, the model runner built the same way on every
rank, and the tensor-parallel ranks (rank 0's side and the followers)."""
