"""The 7-state extraction pipeline: a sloppy first extraction is repaired, then committed.

Run: python examples/extraction_pipeline.py
"""

from _common import main

if __name__ == "__main__":
    main(
        "extraction",
        {
            "document": "Report mentioning Ada, Acme and Paris.",
            "terms": ["Ada", "Acme", "Paris"],
            "sloppy": True,
        },
    )
