"""Speculative decoding's pure half: its configuration, the pace of each row's drafts, and what a
draft token costs."""
