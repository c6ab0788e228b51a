.PHONY: dev test test-pure lint typecheck annotate bench demo docs docs-serve clean ci

dev:
	CFLAGS=-g0 pip install -e '.[test]'

test:
	python -m pytest

test-pure:
	INTERLOCK_NO_EXTENSIONS=1 python -m pytest -m "not slow"

lint:
	ruff check src tests benchmarks examples docs/_hooks
	ruff format --check src tests benchmarks examples docs/_hooks

typecheck:
	mypy

annotate:
	cython -a ext/_hot.pyx

bench:
	python -m benchmarks

demo:
	interlock demo

docs:
	python -m mkdocs build --strict

docs-serve:
	python -m mkdocs serve

ci:
	bash .ci/run

clean:
	rm -rf site build dist src/*.egg-info src/interlock/*.so ext/*.c ext/*.html
