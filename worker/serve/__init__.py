"""The worker as a Redis service: stream intake, the engine loop thread, events and metrics out."""
