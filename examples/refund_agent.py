"""The refund agent: a refund above the order total is rejected, the corrected one commits once.

Run: python examples/refund_agent.py
"""

from _common import main

from interlock.demo.workflows import order_total

ORDER = "ord-100001"
TOTAL = order_total(ORDER)

SCRIPT = [
    f'{{"tool": "lookup_order", "args": {{"order_id": "{ORDER}"}}}}',
    f'{{"tool": "refund", "args": {{"order_id": "{ORDER}", "amount": {TOTAL + 50}, "currency": "USD", "reason": "damaged"}}}}',
    f'{{"tool": "refund", "args": {{"order_id": "{ORDER}", "amount": {TOTAL}, "currency": "USD", "reason": "damaged"}}}}',
    '{"tool": "send_email", "args": {"to": "ada@example.com", "subject": "Refunded", "lines": ["Done."]}}',
    '{"next": "COMPLETED", "data": {"answer": "refunded in full"}}',
]

if __name__ == "__main__":
    main(
        "refund",
        {"order_id": ORDER, "customer": "ada@example.com", "requested": TOTAL + 50},
        SCRIPT,
    )
