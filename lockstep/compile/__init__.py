"""Selective compilation: named regions of model/ops code (``local_compile``) and whole repeated blocks."""
