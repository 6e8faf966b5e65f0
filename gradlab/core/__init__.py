"""The science as pure tensor functions: batches, shared nodes, objectives, cancellation."""
