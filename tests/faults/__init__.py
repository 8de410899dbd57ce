"""The fault campaign (issue 9): `make faults` runs run.py; tests/system/test_faults_short.py runs its short form."""
