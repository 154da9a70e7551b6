"""Bytes on disk, below everything else: safetensors reading and streaming sharded writing (safetensors.py), files
written and flushed so a crash leaves them whole or absent (atomic.py), the fault-injection hook tests use to crash a
run at every write (faults.py), and the exclusive lock on an output directory (lock.py). Imports no other qtk module."""
