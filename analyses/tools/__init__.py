"""Helpers the analysis scripts share and checks of the committed data: `common` (training seeds
into run folders, provenance of a figure), `comparisons` (paired comparisons of objectives over
seeds), `quoted`/`quoted_data` (every number the pages quote against the data), `provenance`
(which code made each figure's runs), `same_runs` (are two run folders the same numbers) and
`view_screenshot` (the screenshot of `gradlab view`).
"""
