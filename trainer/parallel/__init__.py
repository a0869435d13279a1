"""How the processes of a run work together: ``strategy`` (the one object the loop asks: one process, DDP or
FSDP), ``distributed`` (launching, the global batch plan, gradient averaging, crash reports) and ``fsdp``
(sharding a full fine-tune's denoiser). Nothing is imported here: each module is imported by its own name."""
