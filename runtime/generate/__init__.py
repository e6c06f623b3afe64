"""Generation: the KV-cache decoder built from the same model graph, its tape nodes, the
moves of rows by device-held positions, the draw (temperature, top-k, top-p), and the
Sampler that streams text.

Imports engine and model."""
