"""MkDocs hook: generate the pages that must not go stale."""
