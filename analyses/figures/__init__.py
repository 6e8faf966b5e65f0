"""Scripts that make a figure or table of figures/ from real runs: each trains (or reuses) its
runs, writes its CSV, PNG, markdown and a JSON with the provenance and the command that made it,
for example `python -m analyses.figures.figure3 --quick`. verl_audit_findings.md is the
hand-written findings text that `gradlab audit verl --findings` appends under its table.
"""
