"""`python -m prime_rl.rl`, as the `rl` command."""

from prime_rl.rl.cli import main

main()
