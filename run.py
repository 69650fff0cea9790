"""`python run.py [overrides]` from a checkout (and `torchrun ... run.py`): the `dsv4` command, dsv4/app/cli.py."""
from dsv4.app.cli import main

if __name__ == "__main__":
    main()
