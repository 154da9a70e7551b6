"""`python -m qtk ...`: the command line, as the `qtk` script runs it (torchrun starts it this way:
`torchrun --nproc-per-node N -m qtk convert ...`)."""

from qtk.cli import main

main(prog_name="qtk")
