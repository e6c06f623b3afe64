"""The model: its graph described once as data (graph), the architecture checked against
the ops (arch), parameters and the memory plan (params, memory), the tapes that run it
forward and backward (tape, training_tape), and the GPT that owns them (gpt).

Imports engine only."""
