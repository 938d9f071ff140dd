"""The application on top of the daemons (docs/architecture.md): the `muser` command line,
the bench and its peers, the fixture builder, and the lanes that compose both sides in one
process (plain and local). Nothing below imports it."""
