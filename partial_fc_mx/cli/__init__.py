"""The command line, `python -m partial_fc_mx COMMAND ...`: one module per area, each
adding its commands to the parser (`add_commands`) and running them through the
modules that do the work; main.py parses, runs and turns a user's error into one
message and an exit status."""
