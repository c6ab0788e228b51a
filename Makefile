.PHONY: dev test test-pure lint typecheck annotate bench demo clean ci

dev:
	CFLAGS=-g0 pip install -e '.[test]'

test:
	python -m pytest

test-pure:
	INTERLOCK_NO_EXTENSIONS=1 python -m pytest -m "not slow"

lint:
	ruff check src tests benchmarks examples
	ruff format --check src tests benchmarks examples

typecheck:
	mypy

annotate:
	cython -a ext/_hot.pyx

bench:
	python -m benchmarks

demo:
	interlock demo

ci:
	bash .ci/run

clean:
	rm -rf build dist src/*.egg-info src/interlock/*.so ext/*.c ext/*.html
