"""The fault campaign (issue 9): `make faults` runs run.py; tests/test_faults_short.py runs its short form."""
