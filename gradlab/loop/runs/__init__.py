"""The run folder: what a run leaves on disk and how it is read back.

The metrics store and the tidy table (store), per-token W traces (traces), one writer per
folder (lock), resume decisions (resume), live logging to TensorBoard or Trackio (livelog).
Writers above this package import it; it imports nothing that trains.

Imports: faults, config, scale.
"""
