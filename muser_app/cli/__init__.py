"""The `muser` command line: one module per subcommand, imported lazily by `main`."""
