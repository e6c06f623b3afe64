"""The model: its graph described once as data (graph), the architecture checked against
the ops, with its graph (arch), parameters and the memory planner (params, memory), the
GPT's plan (plan), the tapes that run it forward and backward (tape, training_tape), and
the GPT that owns them (gpt).

Imports engine only."""
