"""`tessera dryrun`: a training step of the real recipe rehearsed at full world size on one machine.

fake.py (the fake world and what it answers for), moe.py (even routing), tracker.py (live tensor bytes),
step.py (the measured step, shared with the gloo ground truth), run.py (rank classes, one rank per process),
report.py (verdict, stated terms, advice), planner.py (the planner's terms beside), cli.py. docs/DRYRUN.md.
"""
