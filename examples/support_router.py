"""The support router: the model picks the next state; an illegal pick is rejected.

Run: python examples/support_router.py
"""

from _common import main

SCRIPT = [
    '{"next": "FORMAT_RESPONSE"}',
    '{"next": "QUERY_DB", "data": {"category": "billing", "summary": "double charge"}}',
    '{"next": "DONE", "data": {"response": "We have opened a billing ticket."}}',
]

if __name__ == "__main__":
    main("router", {"ticket": "I was charged twice", "category": "billing"}, SCRIPT)
