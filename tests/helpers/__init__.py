"""Helpers shared by the tests (harnesses, fuzz generators, checks); no tests here."""
