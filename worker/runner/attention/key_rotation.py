"""Calibrated rotations of q and k for a quantized KV cache (a stretch, then the format's fixed
turn): per layer and KV head, one matrix for keys and one for queries, exact for the scores and
chosen so that rounding the stored keys moves the scores as little as it can.

A key stored as ``k T_k`` and read by a query turned as ``q T_q`` gives the same score whenever
``T_q T_k^T = I``: with ``T_k = A R`` and ``T_q = A^-1 R`` (``A`` symmetric positive definite,
``R`` the format's fixed orthogonal turn) it is ``q A^-1 R R^T A k^T = q . k``. Rounding adds an
error ``e`` to the stored row, and the score moves by ``(q T_q) . e``; ``R`` spreads each row's
magnitude so that ``e`` is about as large in every channel, in proportion to the row's size. The
score's error is then about ``tr(A^-1 Sq A^-1) tr(A Sk A)`` over the second moments ``Sq`` and
``Sk`` of queries and keys, which is least at ``A^2 = Sk^-1/2 (Sk^1/2 Sq Sk^1/2)^1/2 Sk^-1/2``:
keys are stretched where queries look hard and keys are small, and shrunk where it is the other
way round. With ``A = I`` this is the plain fixed turn (``KVFormat.rotation``).

The moments come from the model itself reading a short text shipped with the package
(``texts/calibration.txt``, original prose, dialogue, a recipe, a chat and a little code) once at
start, through the cache with the fixed turn; the same weights and text give the same matrices,
so the same tokens still give the same blocks. Measured in docs/engine.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Sequence

import torch

SHRINK = 0.05  # each moment pulled this far toward a multiple of the identity: a few thousand rows estimate 64 x 64


def calibration_text() -> str:
    return resources.files("pagedserve.worker.runner.attention").joinpath("texts/calibration.txt").read_text(encoding="utf-8")


@dataclass(frozen=True)
class KeyRotation:
    """float32 ``[kv_heads, head_dim, head_dim]`` each: queries are multiplied by ``q`` (each by its
    group's KV head's), keys by ``k``; ``q[h] @ k[h].T`` is the identity for every head."""

    q: torch.Tensor
    k: torch.Tensor

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` turned, in float32, back at their dtypes."""
        t, hq, d = q.shape
        hkv = k.shape[1]
        qt = torch.einsum("thgd,hde->thge", q.float().view(t, hkv, hq // hkv, d), self.q)
        kt = torch.einsum("thd,hde->the", k.float(), self.k)
        return qt.reshape(t, hq, d).to(q.dtype), kt.to(k.dtype)


class RotationStats:
    """Second moments of one layer's turned-to-be queries and keys, per KV head (float64 sums)."""

    def __init__(self, kv_heads: int, head_dim: int, device: torch.device) -> None:
        shape = (kv_heads, head_dim, head_dim)
        self.q = torch.zeros(shape, dtype=torch.float64, device=device)
        self.k = torch.zeros(shape, dtype=torch.float64, device=device)
        self.rows = 0

    def add(self, q: torch.Tensor, k: torch.Tensor) -> None:
        t, hq, d = q.shape
        groups = q.double().view(t, k.shape[1], hq // k.shape[1], d)
        self.q += torch.einsum("thgd,thge->hde", groups, groups) / (hq // k.shape[1])
        kd = k.double()
        self.k += torch.einsum("thd,the->hde", kd, kd)
        self.rows += t

    def turns(self, rotation: torch.Tensor) -> KeyRotation:
        """The turns that least move the scores under rounding (module docstring), after ``rotation``."""
        if self.rows == 0:
            raise ValueError("no rows observed: the calibration text ran through no layer")
        stretch = torch.stack([_stretch(_shrunk(sq / self.rows), _shrunk(sk / self.rows))
                               for sq, sk in zip(self.q, self.k)])
        r = rotation.double()
        return KeyRotation(q=(torch.linalg.inv(stretch) @ r).float(), k=(stretch @ r).float())


def _shrunk(moment: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(moment.shape[0], dtype=moment.dtype, device=moment.device)
    return (1 - SHRINK) * moment + SHRINK * moment.diagonal().mean() * eye


def _sqrtm(m: torch.Tensor) -> torch.Tensor:
    """The symmetric positive square root (eigenvalues floored relative to the largest)."""
    values, vectors = torch.linalg.eigh(m)
    values = values.clamp_min(values.max() * 1e-9)
    return (vectors * values.sqrt()) @ vectors.T


def _stretch(sq: torch.Tensor, sk: torch.Tensor) -> torch.Tensor:
    """``A``: the square root of the geometric mean of ``Sk^-1`` and ``Sq``, scaled so that its
    determinant is 1 (the scale changes nothing: each row's own scale absorbs it)."""
    sk_half = _sqrtm(sk)
    sk_half_inv = torch.linalg.inv(sk_half)
    a = _sqrtm(sk_half_inv @ _sqrtm(sk_half @ sq @ sk_half) @ sk_half_inv)
    a = (a + a.T) / 2
    return a / torch.exp(torch.linalg.slogdet(a).logabsdet / a.shape[0])


CHUNK = 512  # calibration tokens per forward: fixed, so the turns do not depend on an engine's token budget


def calibrate(runner, ids: Sequence[int]) -> None:
    """Run ``ids`` through ``runner``'s model as one sequence, ``CHUNK`` tokens a forward, observing every
    layer's queries and keys; then give each layer its turns. ``runner`` is one made for this (a pool
    that holds ``ids``; nothing else uses it), so the turns depend on the text and the model alone,
    never on a pool's size or a token budget: engines of one model store the same tokens alike.
    Attention runs on the torch references here whatever the engine's backend (the same bytes stored,
    the same layout read): the turns do not depend on the backend either, and the Triton kernels
    under ``TRITON_INTERPRET=1`` would take minutes over a text the references read in seconds."""
    from pagedserve.kernels.ops import reference_ops
    from pagedserve.worker.core.scheduling.plan import ScheduledSeq, StepPlan, private_tables

    model, block = runner.model, runner.block_size
    table, lanes = private_tables(-(-len(ids) // block), model.kv_layout.num_lanes)
    if len(table) * (1 + len(lanes)) > runner.kv_pool.shape[1]:
        raise ValueError(f"a calibration of {len(ids)} tokens needs {len(table) * (1 + len(lanes))} blocks; "
                         f"the pool has {runner.kv_pool.shape[1]}")
    attentions = [layer.self_attn.attn for layer in model.model.layers]
    backends = [attention.ops for attention in attentions]
    reference = reference_ops(runner.ops.kv_format)
    for attention in attentions:
        attention.key_rotation, attention.ops = None, reference
        attention.observer = RotationStats(model.num_kv_heads, model.head_dim, runner.device)
    try:
        for start in range(0, len(ids), CHUNK):
            piece = tuple(ids[start : start + CHUNK])
            runner.forward(StepPlan((ScheduledSeq(0, "calibration", piece, start, table, 0, lane_tables=lanes),), block))
        rotation = runner.ops.kv_format.rotation(model.head_dim, runner.device)
        turns = [attention.observer.turns(rotation) for attention in attentions]
    finally:
        runner.tables.forget(["calibration"])
        for attention, ops in zip(attentions, backends):
            attention.observer, attention.ops = None, ops
    for attention, turn in zip(attentions, turns):
        attention.key_rotation = turn
