"""`gradlab audit trl` and `gradlab audit verl`: which trainer settings break cancellation.

    trl.py, trl_options.py, trl_setup.py     TRL's loss settings; its `--options` rows; the
                                             workloads and trainer both use
    verl.py, verl_options.py, verl_setup.py  the same for verl's policy losses
"""
