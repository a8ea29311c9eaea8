"""LoRA's one error, on both sides: an adapter that cannot be served exactly (the agent: the message
names the field or tensor) or a load, unload or swap that cannot be done (the server: HTTP `status`)."""
from __future__ import annotations


class AdapterError(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
