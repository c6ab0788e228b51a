#!/usr/bin/env bash
# An external agent driven with nothing but curl (and jq when it is installed; grep/sed
# otherwise). It owns "the model" (here, a script of proposals) and executes "the tools"
# itself, in shell; the gateway verifies each proposal against the run's state machine,
# issues the idempotency key and journals the intent before it answers.
#
# Usage:
#   examples/external_agent_curl.sh                 # starts `interlock serve` on the demo app
#   INTERLOCK_URL=http://127.0.0.1:8080 examples/external_agent_curl.sh   # a running gateway
#
# Environment: INTERLOCK_URL (a running gateway), INTERLOCK_API_KEY (its bearer key, if it
# has one), INTERLOCK (the command that runs interlock; default `interlock`),
# INTERLOCK_NO_JQ=1 (parse with sed even when jq is installed), RUN_ID (default: generated).
# Exits 0 when the run completed.
set -euo pipefail

ORDER=ord-100001
ORDER_TOTAL=120.0 # what "the orders database" below answers for $ORDER
CUSTOMER=ada@example.com

# -- a gateway -------------------------------------------------------------------------
WORK=$(mktemp -d)
SERVER=""
cleanup() {
	if [ -n "$SERVER" ]; then
		kill -TERM "$SERVER" 2>/dev/null || true # SIGTERM drains, then exits 0
		wait "$SERVER" 2>/dev/null || true
	fi
	rm -rf "$WORK"
}
trap cleanup EXIT

if [ -n "${INTERLOCK_URL:-}" ]; then
	URL=${INTERLOCK_URL%/}
else
	# port 0: the server picks a free port and prints its URL once it listens
	: >"$WORK/serve.log" # exists before the loop reads it, however late the server starts
	# shellcheck disable=SC2086 # INTERLOCK may be a command with arguments
	${INTERLOCK:-interlock} serve --app interlock.demo:app --db "$WORK/journal.db" --port 0 \
		>"$WORK/serve.log" 2>&1 &
	SERVER=$!
	URL=""
	for _ in $(seq 600); do
		URL=$(sed -n 's|^interlock serve: \(http://[^ ]*\) .*|\1|p' "$WORK/serve.log")
		[ -n "$URL" ] && break
		kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/serve.log" >&2; exit 1; }
		sleep 0.1
	done
	[ -n "$URL" ] || { echo "interlock serve did not start within 60 s" >&2; exit 1; }
	echo "gateway: $URL (interlock serve --app interlock.demo:app, journal $WORK/journal.db)"
fi

AUTH=()
[ -n "${INTERLOCK_API_KEY:-}" ] && AUTH=(-H "Authorization: Bearer $INTERLOCK_API_KEY")

# -- JSON in and out -------------------------------------------------------------------
# get PATH JSON: one value of an answer. With jq, PATH is a jq path (.violations[0].hint);
# without, the last name of the path is found with sed (enough for these flat answers).
if command -v jq >/dev/null 2>&1 && [ -z "${INTERLOCK_NO_JQ:-}" ]; then
	PARSER=jq
	get() { printf '%s' "$2" | jq -r "$1 // empty"; }
else
	PARSER=sed
	get() {
		local name=${1##*.}
		name=${name%%\[*}
		printf '%s' "$2" | grep -o "\"$name\":\(\"\([^\"\\\\]\|\\\\.\)*\"\|[^,}]*\)" | head -n 1 |
			sed -e "s/^\"$name\"://" -e 's/^"\(.*\)"$/\1/' -e 's/\\"/"/g' -e '/^null$/d'
	}
fi
# quote TEXT: TEXT as a JSON string (the proposal is sent as the model wrote it, as a string)
quote() { printf '"%s"' "$(printf '%s' "$1" | sed -e 's/\\/\\\\/g' -e 's/"/\\"/g')"; }

# call METHOD PATH [BODY]: sets STATUS and BODY; a problem (4xx/5xx) is printed
call() {
	local out data=()
	[ -n "${3:-}" ] && data=(-H 'Content-Type: application/json' --data-binary "$3")
	out=$(curl -sS -X "$1" "$URL$2" ${AUTH[@]+"${AUTH[@]}"} -H 'Accept: application/json' \
		${data[@]+"${data[@]}"} -w '\n%{http_code}')
	STATUS=${out##*$'\n'}
	BODY=${out%$'\n'*}
	if [ "$STATUS" -ge 400 ]; then
		echo "  problem $STATUS: $(get .title "$BODY"): $(get .detail "$BODY")" >&2
	fi
}

# -- "the tools", executed here --------------------------------------------------------
run_tool() { # run_tool TOOL KEY VERDICT -> prints the result as JSON
	case $1 in
	lookup_order) printf '{"order_id":"%s","total":%s}' "$(get .args.order_id "$3")" "$ORDER_TOTAL" ;;
	refund) # idempotent by the key: a second execution with the same key pays nothing
		local amount
		amount=$(get .args.amount "$3")
		grep -q "^$2 " "$WORK/ledger" 2>/dev/null || echo "$2 $amount" >>"$WORK/ledger"
		printf '{"refund_id":"rf-%s","refunded":%s}' "$(wc -l <"$WORK/ledger" | tr -d ' ')" "$amount"
		;;
	send_email)
		echo "$2 $(get .args.to "$3")" >>"$WORK/outbox"
		printf '{"message_id":"m-%s"}' "$(wc -l <"$WORK/outbox" | tr -d ' ')"
		;;
	*) return 1 ;;
	esac
}

# step PROPOSAL: propose at the run's seq; execute and report an accepted call
step() {
	echo "propose: $1"
	call POST "/v1/runs/$RUN/proposals" "{\"proposal\":$(quote "$1"),\"expected_seq\":$SEQ}"
	[ "$STATUS" = 200 ] || exit 1
	VERDICT=$BODY
	SEQ=$(get .seq "$VERDICT")
	if [ "$(get .accepted "$VERDICT")" != true ]; then
		echo "  rejected: $(get .violations[0].code "$VERDICT") at $(get .violations[0].path "$VERDICT"):" \
			"$(get .violations[0].message "$VERDICT")"
		echo "  hint: $(get .violations[0].hint "$VERDICT")"
		return 0
	fi
	local key tool result
	key=$(get .key "$VERDICT")
	if [ -z "$key" ]; then
		echo "  accepted: now $(get .outcome "$VERDICT") in $(get .state "$VERDICT")"
		return 0
	fi
	tool=$(get .tool "$VERDICT")
	result=$(run_tool "$tool" "$key" "$VERDICT")
	echo "  accepted: $tool with key $key (the intent is journaled); executed: $result"
	call POST "/v1/runs/$RUN/results" "{\"key\":\"$key\",\"result\":$result}"
	[ "$STATUS" = 200 ] || exit 1
	SEQ=$(get .seq "$BODY")
	LAST_KEY=$key LAST_RESULT=$result
	echo "  reported: seq $SEQ"
}

# -- the run ---------------------------------------------------------------------------
RUN=${RUN_ID:-curl-$(date +%s)-$$}
call POST /v1/runs "{\"machine\":\"refund\",\"mode\":\"external\",\"run_id\":\"$RUN\",\"inputs\":{\"order_id\":\"$ORDER\",\"customer\":\"$CUSTOMER\",\"requested\":150.0}}"
[ "$STATUS" = 201 ] || [ "$STATUS" = 200 ] || exit 1
SEQ=$(get .seq "$BODY")
echo "run $RUN: $(get .outcome "$BODY") in state $(get .state "$BODY") at seq $SEQ (parsed with $PARSER)"

step "{\"tool\": \"lookup_order\", \"args\": {\"order_id\": \"$ORDER\"}}"
# the customer asked for 150; the guard knows the order's total from the reported lookup
step "{\"tool\": \"refund\", \"args\": {\"order_id\": \"$ORDER\", \"amount\": 150.0, \"currency\": \"USD\", \"reason\": \"damaged\"}}"
HINT=$(get .violations[0].hint "$VERDICT")
AMOUNT=${HINT##*<= } # "propose amount <= 120.0": the agent takes the hint
step "{\"tool\": \"refund\", \"args\": {\"order_id\": \"$ORDER\", \"amount\": $AMOUNT, \"currency\": \"USD\", \"reason\": \"damaged\"}}"

# a retry after a dropped connection resends the same result: the recorded answer comes
# back, and nothing is journaled or executed twice
call POST "/v1/runs/$RUN/results" "{\"key\":\"$LAST_KEY\",\"result\":$LAST_RESULT}"
echo "retried the refund's result: replayed=$(get .replayed "$BODY"), seq still $(get .seq "$BODY"); ledger: $(wc -l <"$WORK/ledger" | tr -d ' ') refund"

step "{\"tool\": \"send_email\", \"args\": {\"to\": \"$CUSTOMER\", \"subject\": \"Your refund\", \"lines\": [\"We refunded $AMOUNT USD.\"]}}"
step "{\"next\": \"COMPLETED\", \"data\": {\"answer\": \"refunded $AMOUNT USD on $ORDER\"}}"

call GET "/v1/runs/$RUN"
OUTCOME=$(get .outcome "$BODY")
call GET "/v1/runs/$RUN/events?after=0"
echo "run $RUN: $OUTCOME at seq $(get .last_seq "$BODY"); journal: $(printf '%s' "$BODY" | grep -o '"kind":"[a-z_]*"' | sed 's/"kind":"\(.*\)"/\1/' | paste -sd ' ' -)"
[ "$OUTCOME" = completed ]
