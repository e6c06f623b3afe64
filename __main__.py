"""`python -m eulergen`: the CLI, as torchrun's `-m eulergen train …` starts it."""
from eulergen.cli import main

main()
