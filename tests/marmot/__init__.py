"""Tests of the Marmot plugin's protocol layer."""
