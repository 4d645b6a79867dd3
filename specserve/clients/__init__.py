"""The clients of the engine core: the async engine (a thread that owns the engine) and the
protocol front ends are written against."""
