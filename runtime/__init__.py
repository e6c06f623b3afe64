"""The eulergen runtime: numpy on the CPU, CuPy on a GPU.

It loads what `generated/` holds through the manifest and never imports the generator
(DESIGN.md, "Who may import whom")."""
