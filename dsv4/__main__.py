"""`python -m dsv4 [overrides]`: the `dsv4` command."""
from dsv4.app.cli import main

if __name__ == "__main__":
    main()
