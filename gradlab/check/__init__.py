"""`gradlab check`, the regression check of shared-token cancellation (docs/guides/loss-contract.md).

    scenarios.py  the synthetic groups and real tiny-model steps a loss is measured on
    run.py        the scenarios measured, compared and reported (`gradlab check`)
    baseline.py   what a baseline records and how a run is compared against it
"""
