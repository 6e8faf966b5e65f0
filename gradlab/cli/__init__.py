"""gradlab's command line: `gradlab <command>` (docs/reference/cli.md).

    main.py     the commands and their parsers (`gradlab.cli.main:main` is the entry point)
    args.py     argument types, one-line errors, the flags shared by the loop's commands
    help.py     the grouped help text
    doctor.py   `gradlab doctor`: does gradlab work on this machine?
"""
