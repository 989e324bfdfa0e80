"""Subcommands of the ``mixerzoo`` console script that are not Lightning's (``mixerzoo new-plugin``)."""
