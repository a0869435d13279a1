"""The machine a run is on: ``devices`` (which device, what it cannot do), ``procs`` (processes on Linux, macOS
and Windows), ``paths`` (path strings of any OS), ``startup`` (import time) and ``doctor`` (what this machine can
run). Torch-free at import; nothing is imported here."""
