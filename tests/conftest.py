"""Shared pytest set-up: test helpers (models.py, distributed.py, rule_check.py) import by bare name."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
