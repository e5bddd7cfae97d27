# A package so that module names here (test_hf_parity.py, ...) do not clash with tests/models/hf's.
