# cython: boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
# cython: autotestdict=False, binding=False
"""The hot path, compiled: the Cython twin of ``interlock.core._hot_py``.

``interlock.core._hot_py`` is the specification; this module implements the same
names with the same results and the same error text, and ``interlock.core._hotpath``
picks one. Speed tricks stay in ``cdef`` helpers. Each public function has a
fast path for the inputs the runtime really passes (exact ints, byte buffers)
and falls back to the specification's own algorithm on Python objects for
anything else, so that odd inputs still give the same results and errors.

CRC-32 is computed here (slicing-by-8, the IEEE polynomial of ``zlib.crc32``)
rather than by linking zlib, so that the extension builds without zlib headers
on every platform.
"""

cimport cython
from cpython.buffer cimport (
    PyBUF_FULL_RO,
    PyBuffer_IsContiguous,
    PyBUF_SIMPLE,
    PyBuffer_Release,
    PyObject_CheckBuffer,
    PyObject_GetBuffer,
)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsUnsignedLongLongMask
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport Py_LT, PyObject, PyObject_RichCompareBool
from cpython.ref cimport Py_INCREF
from cpython.sequence cimport PySequence_Fast_GET_ITEM, PySequence_Fast_GET_SIZE
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.unicode cimport (
    PyUnicode_1BYTE_KIND,
    PyUnicode_DATA,
    PyUnicode_DecodeUTF8,
    PyUnicode_KIND,
)
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy


cdef extern from "Python.h":
    # cpython.long's declaration, without its exception check: on an exact
    # int this never fails.
    long long _as_long_long "PyLong_AsLongLongAndOverflow" (object value, int* overflow)


cdef enum:
    _OK = 0
    _UNKNOWN_STATE = 1
    _ILLEGAL_TRANSITION = 2
    _UNKNOWN_TOOL = 1
    _TOOL_NOT_ALLOWED = 2
    _FRAMES_OK = 0
    _FRAMES_TORN = 1
    _FRAMES_CORRUPT = 2
    _HEADER_SIZE = 12
    _MAX_IDS = 64

OK = _OK
UNKNOWN_STATE = _UNKNOWN_STATE
ILLEGAL_TRANSITION = _ILLEGAL_TRANSITION
UNKNOWN_TOOL = _UNKNOWN_TOOL
TOOL_NOT_ALLOWED = _TOOL_NOT_ALLOWED
FRAMES_OK = _FRAMES_OK
FRAMES_TORN = _FRAMES_TORN
FRAMES_CORRUPT = _FRAMES_CORRUPT
HEADER_SIZE = _HEADER_SIZE
MAX_IDS = _MAX_IDS

# Python ints for the object fallbacks, which follow _hot_py line by line.
_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_TWO_TO_64 = 2**64

# C copies for the fast paths. NOTE: never mix Python int literals into C
# arithmetic; they would turn the expression into Python-object arithmetic.
cdef uint32_t _ALL_ONES32 = <uint32_t>0xFFFFFFFF
cdef uint32_t _CRC_POLY = <uint32_t>0xEDB88320
cdef uint32_t _CRC_TABLE[8][256]


cdef void _crc_init() noexcept nogil:
    """Fill the slicing-by-8 tables of the reflected IEEE CRC-32."""
    cdef uint32_t crc
    cdef int i, k
    for i in range(256):
        crc = <uint32_t>i
        for k in range(8):
            crc = (crc >> 1) ^ (_CRC_POLY if crc & 1 else 0)
        _CRC_TABLE[0][i] = crc
    for i in range(256):
        crc = _CRC_TABLE[0][i]
        for k in range(1, 8):
            crc = _CRC_TABLE[0][crc & 0xFF] ^ (crc >> 8)
            _CRC_TABLE[k][i] = crc


_crc_init()


cdef inline uint32_t _load32(const unsigned char* p) noexcept nogil:
    return (<uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16)
            | (<uint32_t>p[3] << 24))


cdef inline void _store32(unsigned char* p, uint32_t value) noexcept nogil:
    p[0] = <unsigned char>(value & 0xFF)
    p[1] = <unsigned char>((value >> 8) & 0xFF)
    p[2] = <unsigned char>((value >> 16) & 0xFF)
    p[3] = <unsigned char>(value >> 24)


cdef uint32_t _crc32(const unsigned char* p, Py_ssize_t size) noexcept nogil:
    """Return the CRC-32 of ``size`` bytes at ``p``; equal to ``zlib.crc32``."""
    cdef uint32_t crc = _ALL_ONES32
    cdef uint32_t low, high
    while size >= 8:
        low = crc ^ _load32(p)
        high = _load32(p + 4)
        crc = (_CRC_TABLE[7][low & 0xFF] ^ _CRC_TABLE[6][(low >> 8) & 0xFF]
               ^ _CRC_TABLE[5][(low >> 16) & 0xFF] ^ _CRC_TABLE[4][low >> 24]
               ^ _CRC_TABLE[3][high & 0xFF] ^ _CRC_TABLE[2][(high >> 8) & 0xFF]
               ^ _CRC_TABLE[1][(high >> 16) & 0xFF] ^ _CRC_TABLE[0][high >> 24])
        p += 8
        size -= 8
    while size > 0:
        crc = _CRC_TABLE[0][(crc ^ p[0]) & 0xFF] ^ (crc >> 8)
        p += 1
        size -= 1
    return crc ^ _ALL_ONES32


cdef extern from *:
    """
    /* XXH64 (https://github.com/Cyan4973/xxHash/blob/dev/doc/xxhash_spec.md), as
       _hot_py.hash64 spells it out. Words are read little-endian on every host. */
    #define __PYX_ILK_P1 0x9E3779B185EBCA87ULL
    #define __PYX_ILK_P2 0xC2B2AE3D27D4EB4FULL
    #define __PYX_ILK_P3 0x165667B19E3779F9ULL
    #define __PYX_ILK_P4 0x85EBCA77C2B2AE63ULL
    #define __PYX_ILK_P5 0x27D4EB2F165667C5ULL
    static inline uint64_t __pyx_ilk_rotl(uint64_t x, int r) {
        return (x << r) | (x >> (64 - r));
    }
    static inline uint64_t __pyx_ilk_read64(const unsigned char* p) {
        return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16)
            | ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40)
            | ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
    }
    static inline uint64_t __pyx_ilk_round(uint64_t acc, uint64_t word) {
        return __pyx_ilk_rotl(acc + word * __PYX_ILK_P2, 31) * __PYX_ILK_P1;
    }
    static inline uint64_t __pyx_ilk_merge(uint64_t acc, uint64_t lane) {
        return (acc ^ __pyx_ilk_round(0, lane)) * __PYX_ILK_P1 + __PYX_ILK_P4;
    }
    static uint64_t __pyx_ilk_xxh64(const unsigned char* p, Py_ssize_t size, uint64_t seed) {
        const unsigned char* end = p + size;
        uint64_t value;
        if (size >= 32) {
            const unsigned char* limit = end - 32;
            uint64_t v1 = seed + __PYX_ILK_P1 + __PYX_ILK_P2, v2 = seed + __PYX_ILK_P2;
            uint64_t v3 = seed, v4 = seed - __PYX_ILK_P1;
            do {
                v1 = __pyx_ilk_round(v1, __pyx_ilk_read64(p));
                v2 = __pyx_ilk_round(v2, __pyx_ilk_read64(p + 8));
                v3 = __pyx_ilk_round(v3, __pyx_ilk_read64(p + 16));
                v4 = __pyx_ilk_round(v4, __pyx_ilk_read64(p + 24));
                p += 32;
            } while (p <= limit);
            value = __pyx_ilk_rotl(v1, 1) + __pyx_ilk_rotl(v2, 7) + __pyx_ilk_rotl(v3, 12)
                + __pyx_ilk_rotl(v4, 18);
            value = __pyx_ilk_merge(value, v1);
            value = __pyx_ilk_merge(value, v2);
            value = __pyx_ilk_merge(value, v3);
            value = __pyx_ilk_merge(value, v4);
        } else {
            value = seed + __PYX_ILK_P5;
        }
        value += (uint64_t)size;
        while (end - p >= 8) {
            value ^= __pyx_ilk_round(0, __pyx_ilk_read64(p));
            value = __pyx_ilk_rotl(value, 27) * __PYX_ILK_P1 + __PYX_ILK_P4;
            p += 8;
        }
        if (end - p >= 4) {
            uint64_t half = (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16)
                | ((uint64_t)p[3] << 24);
            value ^= half * __PYX_ILK_P1;
            value = __pyx_ilk_rotl(value, 23) * __PYX_ILK_P2 + __PYX_ILK_P3;
            p += 4;
        }
        while (p < end) {
            value ^= (uint64_t)(*p) * __PYX_ILK_P5;
            value = __pyx_ilk_rotl(value, 11) * __PYX_ILK_P1;
            p++;
        }
        value ^= value >> 33;
        value *= __PYX_ILK_P2;
        value ^= value >> 29;
        value *= __PYX_ILK_P3;
        return value ^ (value >> 32);
    }
    """
    uint64_t _xxh64 "__pyx_ilk_xxh64" (const unsigned char* p, Py_ssize_t size, uint64_t seed) noexcept nogil


cdef extern from *:
    """
    /* The value of an exact int that fits in one digit (every table id does), else
       -1, which is out of range for any id: no call, no overflow bookkeeping. */
    #if PY_VERSION_HEX >= 0x030C0000
    static inline long long __pyx_ilk_small_id(PyObject* value) {
        return PyUnstable_Long_IsCompact((PyLongObject*)value)
            ? (long long)PyUnstable_Long_CompactValue((PyLongObject*)value) : -1;
    }
    #else
    static inline long long __pyx_ilk_small_id(PyObject* value) {
        Py_ssize_t size = Py_SIZE(value);
        if (size == 0) return 0;
        if (size == 1) return (long long)((PyLongObject*)value)->ob_digit[0];
        return -1;
    }
    #endif
    """
    # Exact ints only (callers check the type first); a negative id reads as < 0 either way.
    # Takes a borrowed pointer (no reference is made for the call).
    long long _small_id "__pyx_ilk_small_id" (PyObject* value) noexcept


cdef tuple _select(tuple names, object mask):
    """Return the names whose bit is set in ``mask``, in id order."""
    cdef uint64_t bits
    cdef Py_ssize_t size, count, i, k
    if type(mask) is not int:
        return _select_object(names, mask)
    bits = mask
    size = min(len(names), _MAX_IDS)
    count = 0
    for i in range(size):
        count += (bits >> i) & 1
    result = PyTuple_New(count)
    k = 0
    for i in range(size):
        if (bits >> i) & 1:
            name = names[i]
            Py_INCREF(name)
            PyTuple_SET_ITEM(result, k, name)
            k += 1
    return result


@cython.boundscheck(True)
@cython.wraparound(True)
cdef tuple _select_object(object names, object mask):
    return tuple(name for i, name in enumerate(names) if (mask >> i) & 1)


cdef inline int _bit_code(
    const uint64_t* masks, int rows, int columns, long long row, long long column,
    int unknown, int refused,
) noexcept:
    """OK if bit ``column`` of ``masks[row]`` is set; ``unknown`` for an id out of range."""
    if column < 0 or column >= columns or row < 0 or row >= rows:
        return unknown
    if (masks[row] >> column) & 1:
        return _OK
    return refused


@cython.final
@cython.auto_pickle(False)
cdef class Tables:
    """A machine compiled into integer tables.

    Args:
      states: state names; a state's id is its index.
      tools: tool names; a tool's id is its index.
      edges: per state id, a bitmask of the state ids it may move to.
      tool_masks: per state id, a bitmask of the tool ids allowed there.
      terminal: a bitmask of the terminal state ids.

    Raises:
      ValueError: if the tables do not have one entry per state, or there are
        more than 64 states or tools.
    """

    cdef readonly tuple states
    cdef readonly tuple tools
    cdef readonly tuple edges
    cdef readonly tuple tool_masks
    cdef readonly object terminal
    cdef dict _state_ids
    cdef dict _tool_ids
    # NOTE: 0 <= _n_states, _n_tools <= 64 always, so every id that passes a
    # range check indexes these arrays safely and shifts by less than 64.
    cdef uint64_t _edges[_MAX_IDS]
    cdef uint64_t _tool_masks[_MAX_IDS]
    cdef uint64_t _terminal
    cdef int _n_states
    cdef int _n_tools

    def __init__(self, states, tools, edges, tool_masks, terminal):
        cdef Py_ssize_t i
        cdef Py_ssize_t n_states = len(states)
        cdef Py_ssize_t n_tools = len(tools)
        _check_counts(n_states, n_tools)
        _check_masks(n_states, len(edges), len(tool_masks))
        states_tuple = tuple(states)
        tools_tuple = tuple(tools)
        edges_tuple = tuple([int(mask) & _MASK64 for mask in edges])
        tool_masks_tuple = tuple([int(mask) & _MASK64 for mask in tool_masks])
        terminal_mask = int(terminal) & _MASK64
        state_ids = {name: i for i, name in enumerate(states_tuple)}
        tool_ids = {name: i for i, name in enumerate(tools_tuple)}
        # Checked again on the tuples themselves: the C arrays rely on it.
        _check_counts(len(states_tuple), len(tools_tuple))
        _check_masks(len(states_tuple), len(edges_tuple), len(tool_masks_tuple))
        self.states = states_tuple
        self.tools = tools_tuple
        self.edges = edges_tuple
        self.tool_masks = tool_masks_tuple
        self.terminal = terminal_mask
        self._state_ids = state_ids
        self._tool_ids = tool_ids
        self._n_states = <int>len(states_tuple)
        self._n_tools = <int>len(tools_tuple)
        for i in range(self._n_states):
            self._edges[i] = edges_tuple[i]
            self._tool_masks[i] = tool_masks_tuple[i]
        self._terminal = terminal_mask

    def __reduce__(self):
        return Tables, (self.states, self.tools, self.edges, self.tool_masks, self.terminal)

    cpdef state_id(self, name):
        """Return the id of state ``name``, or -1 if there is no such state."""
        return self._state_ids.get(name, -1)

    cpdef tool_id(self, name):
        """Return the id of tool ``name``, or -1 if there is no such tool."""
        return self._tool_ids.get(name, -1)

    cpdef int check_transition(self, src, dst) except -1:
        """Return OK, UNKNOWN_STATE (``dst`` < 0 or out of range) or ILLEGAL_TRANSITION."""
        if type(src) is not int or type(dst) is not int:
            return self._check_transition_object(src, dst)
        return self._transition_code(_small_id(<PyObject*>src), _small_id(<PyObject*>dst))

    cpdef int check_tool(self, state, tool) except -1:
        """Return OK, UNKNOWN_TOOL (``tool`` < 0 or out of range) or TOOL_NOT_ALLOWED."""
        if type(state) is not int or type(tool) is not int:
            return self._check_tool_object(state, tool)
        return self._tool_code(_small_id(<PyObject*>state), _small_id(<PyObject*>tool))

    cpdef int check_call(self, state, tool) except -1:
        """Return ``check_tool(state_id(state), tool_id(tool))``: the tool check by name."""
        # The name lookups run in _hot_py's order (state first), so an unhashable
        # name raises the same error; the ids they return are exact ints.
        state_id = self._state_ids.get(state, -1)
        tool_id = self._tool_ids.get(tool, -1)
        return self.check_tool(state_id, tool_id)

    cpdef bint is_terminal(self, state) except -1:
        """Return whether ``state`` is a terminal state."""
        cdef long long state_id
        if type(state) is not int:
            return self._is_terminal_object(state)
        state_id = _small_id(<PyObject*>state)
        return 0 <= state_id < self._n_states and (self._terminal >> state_id) & 1

    cpdef tuple legal_next(self, state):
        """Return the names of the states ``state`` may move to, in id order (none for an unknown id)."""
        return _select(self.states, self._mask(self.edges, state))

    cpdef tuple allowed_tools(self, state):
        """Return the names of the tools allowed in ``state``, in id order (none for an unknown id)."""
        return _select(self.tools, self._mask(self.tool_masks, state))

    # The checks on C ids, shared by the methods above; an id that is not a table id
    # (-1 for "not an exact small int") is unknown.

    cdef inline int _transition_code(self, long long source, long long target) noexcept:
        return _bit_code(
            self._edges, self._n_states, self._n_states, source, target,
            _UNKNOWN_STATE, _ILLEGAL_TRANSITION,
        )

    cdef inline int _tool_code(self, long long state_id, long long tool_id) noexcept:
        return _bit_code(
            self._tool_masks, self._n_states, self._n_tools, state_id, tool_id,
            _UNKNOWN_TOOL, _TOOL_NOT_ALLOWED,
        )

    # The _*_object methods are _hot_py's code on Python objects, for ids that
    # are not exact ints (bools, floats, ...): same results, same errors.

    @cython.boundscheck(True)
    @cython.wraparound(True)
    cdef object _mask(self, object masks, object state):
        if type(state) is int and not 0 <= state < self._n_states:
            return 0
        return masks[state]

    @cython.boundscheck(True)
    @cython.wraparound(True)
    cdef int _check_transition_object(self, object src, object dst) except -1:
        cdef object edges = self.edges
        cdef object n = len(self.states)
        if dst < 0 or dst >= n or src < 0 or src >= n:
            return _UNKNOWN_STATE
        if (edges[src] >> dst) & 1:
            return _OK
        return _ILLEGAL_TRANSITION

    @cython.boundscheck(True)
    @cython.wraparound(True)
    cdef int _check_tool_object(self, object state, object tool) except -1:
        cdef object tool_masks = self.tool_masks
        if tool < 0 or tool >= len(self.tools) or state < 0 or state >= len(self.states):
            return _UNKNOWN_TOOL
        if (tool_masks[state] >> tool) & 1:
            return _OK
        return _TOOL_NOT_ALLOWED

    cdef bint _is_terminal_object(self, object state) except -1:
        return 0 <= state < len(self.states) and bool((self.terminal >> state) & 1)


cdef int _check_counts(Py_ssize_t states, Py_ssize_t tools) except -1:
    if states > _MAX_IDS or tools > _MAX_IDS:
        raise ValueError(
            f"tables hold at most {MAX_IDS} states and {MAX_IDS} tools; "
            f"got {states} states and {tools} tools"
        )
    return 0


cdef int _check_masks(Py_ssize_t states, Py_ssize_t edges, Py_ssize_t tool_masks) except -1:
    if edges != states or tool_masks != states:
        raise ValueError(
            f"tables need one edge mask and one tool mask per state; got {states} "
            f"states, {edges} edge masks and {tool_masks} tool masks"
        )
    return 0


cdef struct _Part:
    Py_buffer view
    Py_ssize_t size  # len(payload): the length _hot_py writes into the header


cdef int _open_part(object payload, _Part* part) except -1:
    """Measure and acquire one payload, raising what ``_hot_py.frame_event`` raises."""
    part.size = len(payload)
    if <uint64_t>part.size > <uint64_t>_ALL_ONES32:
        raise ValueError(
            f"event payload of {part.size} bytes exceeds the 4 GiB frame limit"
        )
    # PyBUF_SIMPLE is what zlib.crc32 asks for: same errors, same raw bytes.
    PyObject_GetBuffer(payload, &part.view, PyBUF_SIMPLE)
    return 0


cdef unsigned char* _write_frame(unsigned char* out, const _Part* part) noexcept nogil:
    cdef const unsigned char* data = <const unsigned char*>part.view.buf
    cdef Py_ssize_t length = part.view.len
    cdef uint32_t size = <uint32_t>part.size
    _store32(out, size)
    _store32(out + 4, size ^ _ALL_ONES32)
    _store32(out + 8, _crc32(data, length))
    if length:
        memcpy(out + _HEADER_SIZE, data, <size_t>length)
    return out + _HEADER_SIZE + length


def frame_event(payload):
    """Return ``payload`` framed with its length, the length's complement and its crc32."""
    cdef _Part part
    _open_part(payload, &part)
    try:
        framed = PyBytes_FromStringAndSize(NULL, _HEADER_SIZE + part.view.len)
        _write_frame(<unsigned char*>PyBytes_AS_STRING(framed), &part)
    finally:
        PyBuffer_Release(&part.view)
    return framed


def frame_events(payloads):
    """Return all ``payloads`` framed into one contiguous buffer, ready to flush."""
    cdef tuple items = tuple(payloads)
    cdef Py_ssize_t count = len(items)
    cdef Py_ssize_t opened = 0
    cdef Py_ssize_t total = 0
    cdef Py_ssize_t i
    cdef unsigned char* out
    cdef _Part* parts
    if count == 0:
        return b""
    parts = <_Part*>PyMem_Malloc(<size_t>count * sizeof(_Part))
    if parts == NULL:
        raise MemoryError()
    try:
        for i in range(count):
            _open_part(items[i], &parts[i])
            opened += 1
            total += _HEADER_SIZE + parts[i].view.len
        # One allocation for the whole batch, filled in place.
        framed = PyBytes_FromStringAndSize(NULL, total)
        out = <unsigned char*>PyBytes_AS_STRING(framed)
        for i in range(count):
            out = _write_frame(out, &parts[i])
    finally:
        for i in range(opened):
            PyBuffer_Release(&parts[i].view)
        PyMem_Free(parts)
    return framed


def unframe(buffer):
    """Split a buffer of frames back into payloads.

    Returns:
      ``(payloads, good_end, status)``: the payloads of the leading valid frames,
      the offset just past the last valid frame, and FRAMES_OK, FRAMES_TORN (the
      buffer ends inside a frame: a write was cut short) or FRAMES_CORRUPT (a
      frame's header or checksum does not match). Decoding stops at the first
      bad frame; nothing after it is trusted.
    """
    cdef Py_buffer view
    cdef const unsigned char* data
    cdef Py_ssize_t total
    cdef Py_ssize_t offset = 0
    cdef Py_ssize_t start
    cdef uint32_t size
    cdef int status = _FRAMES_OK
    cdef list payloads = []
    memory = memoryview(buffer)
    PyObject_GetBuffer(memory, &view, PyBUF_FULL_RO)
    try:
        if not (
            view.ndim == 1
            and view.itemsize == 1
            and view.suboffsets == NULL
            and (view.strides == NULL or view.strides[0] == 1)
        ):
            return _unframe_object(memory)
        data = <const unsigned char*>view.buf
        total = view.len
        while offset < total:
            if total - offset < _HEADER_SIZE:
                status = _FRAMES_TORN
                break
            size = _load32(data + offset)
            if size ^ _load32(data + offset + 4) != _ALL_ONES32:
                status = _FRAMES_CORRUPT
                break
            start = offset + _HEADER_SIZE
            if <uint64_t>(total - start) < <uint64_t>size:
                status = _FRAMES_TORN
                break
            if _crc32(data + start, size) != _load32(data + offset + 8):
                status = _FRAMES_CORRUPT
                break
            payloads.append(PyBytes_FromStringAndSize(<const char*>data + start, size))
            offset = start + size
    finally:
        PyBuffer_Release(&view)
    return payloads, offset, status


@cython.boundscheck(True)
@cython.wraparound(True)
cdef tuple _unframe_object(object view):
    """``_hot_py.unframe`` for buffers that are not contiguous 1-D bytes."""
    total = len(view)
    payloads = []
    offset = 0
    while offset < total:
        if total - offset < HEADER_SIZE:
            return payloads, offset, FRAMES_TORN
        size = int.from_bytes(view[offset : offset + 4], "little")
        check = int.from_bytes(view[offset + 4 : offset + 8], "little")
        if size ^ check != _MASK32:
            return payloads, offset, FRAMES_CORRUPT
        crc = int.from_bytes(view[offset + 8 : offset + 12], "little")
        start = offset + HEADER_SIZE
        if total - start < size:
            return payloads, offset, FRAMES_TORN
        payload = bytes(view[start : start + size])
        if _crc32(<const unsigned char*>PyBytes_AS_STRING(payload), len(payload)) != crc:
            return payloads, offset, FRAMES_CORRUPT
        payloads.append(payload)
        offset = start + size
    return payloads, offset, FRAMES_OK


def compact_failures(signatures):
    """Collapse runs of identical consecutive failures in a run's history.

    Args:
      signatures: one entry per history item; 0 for an item that is not a
        failure, otherwise the failure's signature (e.g. a hash of code + path).

    Returns:
      A list of ``(first, last, count)`` index groups covering every item in
      order: each maximal run of equal non-zero signatures becomes one group,
      every other item a group of its own.
    """
    if type(signatures) is list or type(signatures) is tuple:
        groups = _compact_ints(signatures)
        if groups is not None:
            return groups
    return _compact_object(signatures)


cdef bint _signature_key(object item, uint64_t* bits, uint8_t* negative) except -1:
    """Map an exact int in [-2**63, 2**64) to a distinct (bits, negative) key, or return False."""
    cdef int overflow = 0
    cdef long long value
    if type(item) is not int:
        return False
    value = _as_long_long(item, &overflow)
    if overflow == 0:
        bits[0] = <uint64_t>value
        negative[0] = value < 0
        return True
    if overflow < 0 or not PyObject_RichCompareBool(item, _TWO_TO_64, Py_LT):
        return False
    bits[0] = PyLong_AsUnsignedLongLongMask(item)
    negative[0] = 0
    return True


cdef Py_ssize_t _compact_scan(
    const uint64_t* bits, const uint8_t* negative, Py_ssize_t count, Py_ssize_t* firsts
) noexcept nogil:
    """Write the first index of each group into ``firsts``; return the number of groups."""
    cdef Py_ssize_t groups = 0
    cdef Py_ssize_t i = 0
    cdef Py_ssize_t j
    while i < count:
        j = i
        if bits[i] != 0:
            while j + 1 < count and bits[j + 1] == bits[i] and negative[j + 1] == negative[i]:
                j += 1
        firsts[groups] = i
        groups += 1
        i = j + 1
    return groups


cdef list _compact_ints(object signatures):
    """The fast path for a list or tuple of ints; None if an item is anything else."""
    cdef Py_ssize_t count = PySequence_Fast_GET_SIZE(signatures)
    cdef Py_ssize_t groups, g, first, last
    cdef uint64_t* bits
    cdef uint8_t* negative
    cdef Py_ssize_t* firsts
    cdef Py_ssize_t i
    cdef object first_index, last_index
    cdef list result = []
    if count == 0:
        return result
    bits = <uint64_t*>PyMem_Malloc(<size_t>count * sizeof(uint64_t))
    negative = <uint8_t*>PyMem_Malloc(<size_t>count * sizeof(uint8_t))
    firsts = <Py_ssize_t*>PyMem_Malloc(<size_t>count * sizeof(Py_ssize_t))
    try:
        if bits == NULL or negative == NULL or firsts == NULL:
            raise MemoryError()
        # Converting exact ints runs no Python code, so the list cannot change meanwhile.
        for i in range(count):
            if not _signature_key(
                <object>PySequence_Fast_GET_ITEM(signatures, i), &bits[i], &negative[i]
            ):
                return None
        groups = _compact_scan(bits, negative, count, firsts)
        for g in range(groups):
            first = firsts[g]
            last = (firsts[g + 1] if g + 1 < groups else count) - 1
            first_index = first
            # One int object for both ends of a single-item group, as in _hot_py.
            last_index = first_index if last == first else last
            result.append((first_index, last_index, last - first + 1))
    finally:
        PyMem_Free(bits)
        PyMem_Free(negative)
        PyMem_Free(firsts)
    return result


@cython.boundscheck(True)
@cython.wraparound(True)
cdef list _compact_object(object signatures):
    groups = []
    count = len(signatures)
    i = 0
    while i < count:
        signature = signatures[i]
        j = i
        if signature != 0:
            while j + 1 < count and signatures[j + 1] == signature:
                j += 1
        groups.append((i, j, j - i + 1))
        i = j + 1
    return groups


def hash64(data, seed=0):
    """Return the XXH64 hash of ``data`` (a bytes-like object), starting from ``seed``.

    This is xxHash's 64-bit variant, bit for bit: ``hash64(b"") == 0xEF46DB3751D8E999``.
    ``seed`` is reduced to 64 bits (``seed & (2**64 - 1)``).

    Raises:
      TypeError: if ``data`` is not a bytes-like object or ``seed`` is not an int.
    """
    cdef Py_buffer view
    cdef uint64_t value
    if type(seed) is not int and type(seed) is not bool:
        raise TypeError(f"hash64() seed must be an int, not {type(seed).__name__!r}")
    value = PyLong_AsUnsignedLongLongMask(seed)  # == seed & _MASK64
    if type(data) is bytes:
        return _xxh64(
            <const unsigned char*>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data), value
        )
    if not PyObject_CheckBuffer(data):
        raise TypeError(f"hash64() needs a bytes-like object, not {type(data).__name__!r}")
    PyObject_GetBuffer(data, &view, PyBUF_FULL_RO)
    try:
        if not PyBuffer_IsContiguous(&view, b"C"):
            raise TypeError("hash64() needs a contiguous buffer; copy it with bytes() first")
        return _xxh64(<const unsigned char*>view.buf, view.len, value)
    finally:
        PyBuffer_Release(&view)


def proposal_hash(tool, canonical_args):
    """Return the repeat breaker's hash of a tool call: XXH64 of the args, seeded with the tool's.

    ``canonical_args`` must already be canonical (sorted keys, as _view.canonical_args), so that
    equal calls hash equal whatever their key order.
    """
    if type(tool) is bytes and type(canonical_args) is bytes:
        return _xxh64(
            <const unsigned char*>PyBytes_AS_STRING(canonical_args),
            PyBytes_GET_SIZE(canonical_args),
            _xxh64(<const unsigned char*>PyBytes_AS_STRING(tool), PyBytes_GET_SIZE(tool), 0),
        )
    return hash64(canonical_args, hash64(tool))


cdef inline Py_ssize_t _common_prefix(
    const unsigned char* a, const unsigned char* b, Py_ssize_t size
) noexcept nogil:
    """How many leading bytes of ``a`` and ``b`` (``size`` each) are equal."""
    cdef Py_ssize_t i = 0
    cdef uint64_t x, y
    while i + 8 <= size:  # a word at a time; memcpy is an unaligned load
        memcpy(&x, a + i, 8)
        memcpy(&y, b + i, 8)
        if x != y:
            break
        i += 8
    while i < size and a[i] == b[i]:
        i += 1
    return i


cdef inline Py_ssize_t _common_suffix(
    const unsigned char* a_end, const unsigned char* b_end, Py_ssize_t size
) noexcept nogil:
    """How many trailing bytes before ``a_end`` and ``b_end`` (at most ``size``) are equal."""
    cdef Py_ssize_t i = 0
    cdef uint64_t x, y
    while i + 8 <= size:
        memcpy(&x, a_end - i - 8, 8)
        memcpy(&y, b_end - i - 8, 8)
        if x != y:
            break
        i += 8
    while i < size and a_end[-i - 1] == b_end[-i - 1]:
        i += 1
    return i


def common_affixes(old, new):
    """Return ``(prefix, suffix)``: how many leading and trailing characters ``new`` shares with ``old``.

    Same contract as ``_hot_py.common_affixes``: the longest common prefix, then
    the longest common suffix that does not overlap it.
    """
    if type(old) is not str or type(new) is not str:
        raise TypeError(
            f"common_affixes() takes two str, got {type(old).__name__} and {type(new).__name__}"
        )
    cdef str a = <str>old
    cdef str b = <str>new
    cdef Py_ssize_t len_a = len(a), len_b = len(b)
    cdef Py_ssize_t limit = len_a if len_a < len_b else len_b
    cdef Py_ssize_t prefix = 0, suffix = 0
    cdef int kind_a = PyUnicode_KIND(a), kind_b = PyUnicode_KIND(b)
    cdef const unsigned char* data_a
    cdef const unsigned char* data_b
    if kind_a == kind_b:
        # One storage width: equal characters are equal bytes, so compare the raw
        # buffers a word at a time (the common case: a prompt is ASCII, or wide all
        # through). A character matches when all of its bytes do, so the byte counts
        # round down to whole characters.
        data_a = <const unsigned char*>PyUnicode_DATA(a)
        data_b = <const unsigned char*>PyUnicode_DATA(b)
        prefix = _common_prefix(data_a, data_b, limit * kind_a) // kind_a
        limit -= prefix
        suffix = _common_suffix(
            data_a + len_a * kind_a, data_b + len_b * kind_a, limit * kind_a
        ) // kind_a
        return prefix, suffix
    while prefix < limit and a[prefix] == b[prefix]:
        prefix += 1
    limit -= prefix
    while suffix < limit and a[len_a - 1 - suffix] == b[len_b - 1 - suffix]:
        suffix += 1
    return prefix, suffix


# -- reading a proposal exactly: _hot_py.scan_json and its helpers, in C --------------

cdef enum:
    _JSON_EMPTY = 1
    _JSON_TRUNCATED = 2
    _JSON_TRAILING_TEXT = 3
    _JSON_EXPECTED_VALUE = 4
    _JSON_EXPECTED_KEY = 5
    _JSON_EXPECTED_COLON = 6
    _JSON_EXPECTED_COMMA = 7
    _JSON_TRAILING_COMMA = 8
    _JSON_BAD_NUMBER = 9
    _JSON_BAD_ESCAPE = 10
    _JSON_LONE_SURROGATE = 11
    _JSON_BAD_UTF8 = 12
    _JSON_CONTROL_CHARACTER = 13
    _JSON_DUPLICATE_KEY = 14
    # The parser's states, as in _hot_py.
    _VALUE = 0
    _FIRST_ITEM = 1
    _ITEM = 2
    _FIRST_KEY = 3
    _KEY = 4
    _COLON = 5
    _AFTER = 6
    # Frames and key slots that live in the scanner itself, before any allocation.
    _SMALL = 16

JSON_EMPTY = _JSON_EMPTY
JSON_TRUNCATED = _JSON_TRUNCATED
JSON_TRAILING_TEXT = _JSON_TRAILING_TEXT
JSON_EXPECTED_VALUE = _JSON_EXPECTED_VALUE
JSON_EXPECTED_KEY = _JSON_EXPECTED_KEY
JSON_EXPECTED_COLON = _JSON_EXPECTED_COLON
JSON_EXPECTED_COMMA = _JSON_EXPECTED_COMMA
JSON_TRAILING_COMMA = _JSON_TRAILING_COMMA
JSON_BAD_NUMBER = _JSON_BAD_NUMBER
JSON_BAD_ESCAPE = _JSON_BAD_ESCAPE
JSON_LONE_SURROGATE = _JSON_LONE_SURROGATE
JSON_BAD_UTF8 = _JSON_BAD_UTF8
JSON_CONTROL_CHARACTER = _JSON_CONTROL_CHARACTER
JSON_DUPLICATE_KEY = _JSON_DUPLICATE_KEY


cdef struct _Frame:
    # An open object (index -1) or array. An object's current key, as UTF-8 (NULL
    # until its first key is read), and its serial number, which seeds its keys'
    # hashes so that one table holds the keys of every object.
    const unsigned char* key
    Py_ssize_t key_size
    Py_ssize_t index
    uint64_t serial


cdef struct _Key:
    # A slot of the key table (open addressing, linear probing); empty while text is NULL.
    const unsigned char* text
    Py_ssize_t size
    uint64_t hash
    uint64_t serial


cdef struct _Scanner:
    const unsigned char* data
    Py_ssize_t size
    int code
    Py_ssize_t offset
    _Frame* frames
    Py_ssize_t depth
    Py_ssize_t frames_room
    _Key* keys
    Py_ssize_t keys_used
    Py_ssize_t keys_room  # a power of two
    uint64_t serials
    unsigned char* decoded  # the escaped keys, unescaped (at most len(data) bytes in all)
    Py_ssize_t decoded_size
    _Frame small_frames[_SMALL]
    _Key small_keys[_SMALL]


cdef inline Py_ssize_t _defect(_Scanner* s, int code, Py_ssize_t offset) noexcept nogil:
    """Record the first defect; the helpers return its -1."""
    s.code = code
    s.offset = offset
    return -1


cdef inline bint _is_space(unsigned char byte) noexcept nogil:
    return byte == 32 or byte == 9 or byte == 10 or byte == 13


cdef inline bint _is_digit(unsigned char byte) noexcept nogil:
    return 48 <= byte <= 57


cdef inline int _hex_value(unsigned char byte) noexcept nogil:
    if 48 <= byte <= 57:
        return byte - 48
    if 97 <= byte <= 102:
        return byte - 87
    if 65 <= byte <= 70:
        return byte - 55
    return -1


def scan_json(data):
    """Find the first defect that keeps ``data`` from reading as exactly one JSON value.

    Same contract as ``_hot_py.scan_json``: None, or ``(code, offset, path)`` of the
    defect that starts first.
    """
    cdef _Scanner s
    cdef Py_ssize_t i
    if type(data) is not bytes:
        data = _as_bytes(data)
    s.data = <const unsigned char*>PyBytes_AS_STRING(data)
    s.size = PyBytes_GET_SIZE(data)
    s.code = 0
    s.offset = 0
    s.frames = s.small_frames
    s.depth = 0
    s.frames_room = _SMALL
    s.keys = s.small_keys
    s.keys_used = 0
    s.keys_room = _SMALL
    s.serials = 0
    s.decoded = NULL
    s.decoded_size = 0
    for i in range(_SMALL):
        s.small_keys[i].text = NULL
    try:
        if _scan(&s) == 0:
            return None
        return s.code, s.offset, _path(&s)
    finally:
        if s.frames != s.small_frames:
            PyMem_Free(s.frames)
        if s.keys != s.small_keys:
            PyMem_Free(s.keys)
        PyMem_Free(s.decoded)


@cython.boundscheck(True)
@cython.wraparound(True)
cdef bytes _as_bytes(object data):
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(
            f"scan_json() needs a bytes-like object, not {type(data).__name__!r}"
        ) from None
    with view:
        return view.tobytes()


cdef tuple _path(_Scanner* s):
    """The keys and indices of the open frames, as _hot_py's path."""
    cdef Py_ssize_t i
    cdef _Frame* frame
    parts = []
    for i in range(s.depth):
        frame = &s.frames[i]
        if frame.index >= 0:
            parts.append(frame.index)
        elif frame.key != NULL:
            parts.append(PyUnicode_DecodeUTF8(<const char*>frame.key, frame.key_size, NULL))
    return tuple(parts)


cdef int _scan(_Scanner* s) except -2:
    """_hot_py._scan: 0 for one JSON value without a defect, else -1 with the defect recorded."""
    cdef const unsigned char* data = s.data
    cdef Py_ssize_t size = s.size
    cdef Py_ssize_t at = 0
    cdef Py_ssize_t end
    cdef int state = _VALUE
    cdef unsigned char byte
    cdef bint escaped
    cdef _Frame* frame
    while True:
        while at < size and _is_space(data[at]):
            at += 1
        if at == size:
            if state == _AFTER and s.depth == 0:
                return 0
            return <int>_defect(
                s, _JSON_EMPTY if state == _VALUE and s.depth == 0 else _JSON_TRUNCATED, at
            )
        byte = data[at]
        if state == _AFTER:
            if s.depth == 0:
                return <int>_defect(s, _JSON_TRAILING_TEXT, at)
            frame = &s.frames[s.depth - 1]
            if byte == 44:  # ,
                if frame.index < 0:
                    frame.key = NULL
                    state = _KEY
                else:
                    frame.index += 1
                    state = _ITEM
                at += 1
            elif byte == (125 if frame.index < 0 else 93):  # } or ]
                s.depth -= 1
                at += 1
            else:
                return <int>_defect(s, _JSON_EXPECTED_COMMA, at)
        elif state == _COLON:
            if byte != 58:  # :
                return <int>_defect(s, _JSON_EXPECTED_COLON, at)
            state = _VALUE
            at += 1
        elif state == _FIRST_KEY or state == _KEY:
            if byte == 125:  # }
                if state == _KEY:
                    return <int>_defect(s, _JSON_TRAILING_COMMA, at)
                s.depth -= 1
                state = _AFTER
                at += 1
                continue
            if byte != 34:  # "
                return <int>_defect(s, _JSON_EXPECTED_KEY, at)
            end = _string(s, at, &escaped)
            if end < 0:
                return -1
            if _read_key(s, at, end, escaped) != 0:
                return <int>_defect(s, _JSON_DUPLICATE_KEY, at)
            state = _COLON
            at = end
        elif byte == 93 and (state == _FIRST_ITEM or state == _ITEM):  # ]
            if state == _ITEM:
                return <int>_defect(s, _JSON_TRAILING_COMMA, at)
            s.depth -= 1
            state = _AFTER
            at += 1
        elif byte == 123:  # {
            frame = _push(s)
            s.serials += 1
            frame.index = -1
            frame.serial = s.serials
            state = _FIRST_KEY
            at += 1
        elif byte == 91:  # [
            frame = _push(s)
            frame.index = 0
            state = _FIRST_ITEM
            at += 1
        else:
            at = _scalar(s, at)
            if at < 0:
                return -1
            state = _AFTER


cdef _Frame* _push(_Scanner* s) except NULL:
    """A new innermost frame, with no key yet."""
    cdef _Frame* frames
    cdef _Frame* frame
    if s.depth == s.frames_room:
        frames = <_Frame*>PyMem_Malloc(<size_t>(2 * s.frames_room) * sizeof(_Frame))
        if frames == NULL:
            raise MemoryError()
        memcpy(frames, s.frames, <size_t>s.depth * sizeof(_Frame))
        if s.frames != s.small_frames:
            PyMem_Free(s.frames)
        s.frames = frames
        s.frames_room *= 2
    frame = &s.frames[s.depth]
    s.depth += 1
    frame.key = NULL
    frame.key_size = 0
    return frame


cdef int _read_key(_Scanner* s, Py_ssize_t start, Py_ssize_t end, bint escaped) except -2:
    """Make the string at ``start`` the innermost object's key: 1 if it already had it."""
    cdef _Frame* frame = &s.frames[s.depth - 1]
    cdef const unsigned char* text = s.data + start + 1
    cdef Py_ssize_t size = end - start - 2
    cdef unsigned char* out
    if escaped:
        if s.decoded == NULL:
            s.decoded = <unsigned char*>PyMem_Malloc(<size_t>s.size)
            if s.decoded == NULL:
                raise MemoryError()
        out = s.decoded + s.decoded_size
        size = _unescape(text, size, out)
        s.decoded_size += size
        text = out
    frame.key = text
    frame.key_size = size
    return _add_key(s, text, size, frame.serial)


cdef int _add_key(
    _Scanner* s, const unsigned char* text, Py_ssize_t size, uint64_t serial
) except -2:
    """Put a key of object ``serial`` in the table: 1 if it was there already."""
    cdef uint64_t hash = _xxh64(text, size, serial)
    cdef Py_ssize_t mask, slot
    cdef _Key* key
    if 2 * (s.keys_used + 1) > s.keys_room:
        _grow_keys(s)
    mask = s.keys_room - 1
    slot = <Py_ssize_t>(hash & <uint64_t>mask)
    while True:
        key = &s.keys[slot]
        if key.text == NULL:
            break
        if (
            key.hash == hash
            and key.serial == serial
            and key.size == size
            and (size == 0 or memcmp(key.text, text, <size_t>size) == 0)
        ):
            return 1
        slot = (slot + 1) & mask
    key.text = text
    key.size = size
    key.hash = hash
    key.serial = serial
    s.keys_used += 1
    return 0


cdef int _grow_keys(_Scanner* s) except -1:
    """Double the key table (the keys of closed objects stay: they can never match)."""
    cdef Py_ssize_t room = 2 * s.keys_room
    cdef Py_ssize_t mask = room - 1
    cdef Py_ssize_t i, slot
    cdef _Key* keys = <_Key*>PyMem_Malloc(<size_t>room * sizeof(_Key))
    if keys == NULL:
        raise MemoryError()
    for i in range(room):
        keys[i].text = NULL
    for i in range(s.keys_room):
        if s.keys[i].text != NULL:
            slot = <Py_ssize_t>(s.keys[i].hash & <uint64_t>mask)
            while keys[slot].text != NULL:
                slot = (slot + 1) & mask
            keys[slot] = s.keys[i]
    if s.keys != s.small_keys:
        PyMem_Free(s.keys)
    s.keys = keys
    s.keys_room = room
    return 0


cdef Py_ssize_t _unescape(
    const unsigned char* text, Py_ssize_t size, unsigned char* out
) noexcept nogil:
    """Write the UTF-8 of a string body that _string accepted; return its length."""
    cdef Py_ssize_t i = 0
    cdef Py_ssize_t n = 0
    cdef unsigned char kind
    cdef uint32_t code
    while i < size:
        if text[i] != 92:  # not a backslash
            out[n] = text[i]
            n += 1
            i += 1
            continue
        kind = text[i + 1]
        if kind != 117:  # a one-character escape
            out[n] = (
                8 if kind == 98 else 12 if kind == 102 else 10 if kind == 110
                else 13 if kind == 114 else 9 if kind == 116 else kind
            )
            n += 1
            i += 2
            continue
        code = _hex4_value(text + i + 2)
        i += 6
        if 0xD800 <= code <= 0xDBFF:  # the low half follows (_escape checked)
            code = 0x10000 + ((code - 0xD800) << 10) + (_hex4_value(text + i + 2) - 0xDC00)
            i += 6
        if code < 0x80:
            out[n] = <unsigned char>code
            n += 1
        elif code < 0x800:
            out[n] = <unsigned char>(0xC0 | (code >> 6))
            out[n + 1] = <unsigned char>(0x80 | (code & 0x3F))
            n += 2
        elif code < 0x10000:
            out[n] = <unsigned char>(0xE0 | (code >> 12))
            out[n + 1] = <unsigned char>(0x80 | ((code >> 6) & 0x3F))
            out[n + 2] = <unsigned char>(0x80 | (code & 0x3F))
            n += 3
        else:
            out[n] = <unsigned char>(0xF0 | (code >> 18))
            out[n + 1] = <unsigned char>(0x80 | ((code >> 12) & 0x3F))
            out[n + 2] = <unsigned char>(0x80 | ((code >> 6) & 0x3F))
            out[n + 3] = <unsigned char>(0x80 | (code & 0x3F))
            n += 4
    return n


cdef inline uint32_t _hex4_value(const unsigned char* digits) noexcept nogil:
    return <uint32_t>(
        (_hex_value(digits[0]) << 12) | (_hex_value(digits[1]) << 8)
        | (_hex_value(digits[2]) << 4) | _hex_value(digits[3])
    )


cdef Py_ssize_t _scalar(_Scanner* s, Py_ssize_t at) noexcept nogil:
    """Read the string, number or literal at ``at``; return the offset just past it."""
    cdef unsigned char byte = s.data[at]
    cdef const char* word
    cdef Py_ssize_t length, end
    cdef bint escaped
    if byte == 34:  # "
        return _string(s, at, &escaped)
    if byte == 45 or _is_digit(byte):  # - or a digit
        return _number(s, at)
    if byte == 116:
        word, length = b"true", 4
    elif byte == 102:
        word, length = b"false", 5
    elif byte == 110:
        word, length = b"null", 4
    else:
        return _defect(s, _JSON_EXPECTED_VALUE, at)
    end = at + length if at + length < s.size else s.size
    if memcmp(s.data + at, word, <size_t>(end - at)) != 0:
        return _defect(s, _JSON_EXPECTED_VALUE, at)
    if end - at < length:
        return _defect(s, _JSON_TRUNCATED, s.size)
    return end


cdef Py_ssize_t _number(_Scanner* s, Py_ssize_t start) noexcept nogil:
    """Read the number at ``start``: ``-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?``."""
    cdef const unsigned char* data = s.data
    cdef Py_ssize_t size = s.size
    cdef Py_ssize_t at = start + 1 if data[start] == 45 else start
    if at < size and data[at] == 48:  # 0
        at += 1
        if at < size and _is_digit(data[at]):
            return _defect(s, _JSON_BAD_NUMBER, start)  # a leading zero, as in 01
    else:
        at = _digits(s, at, start)
        if at < 0:
            return -1
    if at < size and data[at] == 46:  # .
        at = _digits(s, at + 1, start)
        if at < 0:
            return -1
    if at < size and (data[at] == 101 or data[at] == 69):  # e or E
        at += 1
        if at < size and (data[at] == 43 or data[at] == 45):  # + or -
            at += 1
        at = _digits(s, at, start)
    return at


cdef Py_ssize_t _digits(_Scanner* s, Py_ssize_t at, Py_ssize_t start) noexcept nogil:
    """Read the one or more digits at ``at`` of the number at ``start``."""
    if at == s.size:
        return _defect(s, _JSON_TRUNCATED, at)
    if not _is_digit(s.data[at]):
        return _defect(s, _JSON_BAD_NUMBER, start)
    while at < s.size and _is_digit(s.data[at]):
        at += 1
    return at


cdef Py_ssize_t _string(_Scanner* s, Py_ssize_t start, bint* escaped) noexcept nogil:
    """Read the string at ``start``; return the offset past it, and whether it has escapes."""
    cdef const unsigned char* data = s.data
    cdef Py_ssize_t size = s.size
    cdef Py_ssize_t at = start + 1
    cdef unsigned char byte
    escaped[0] = False
    while True:
        if at == size:
            return _defect(s, _JSON_TRUNCATED, size)
        byte = data[at]
        if byte == 34:  # "
            return at + 1
        if byte == 92:  # a backslash
            escaped[0] = True
            at = _escape(s, at)
            if at < 0:
                return -1
        elif byte < 32:
            return _defect(s, _JSON_CONTROL_CHARACTER, at)
        elif byte < 128:
            at += 1
        else:
            at = _utf8(s, at)
            if at < 0:
                return -1


cdef Py_ssize_t _utf8(_Scanner* s, Py_ssize_t at) noexcept nogil:
    """Read the UTF-8 sequence that starts at ``at`` (Unicode's table 3-7 of well-formed ones)."""
    cdef const unsigned char* data = s.data
    cdef unsigned char lead = data[at]
    cdef unsigned char low = 0x80
    cdef unsigned char high = 0xBF
    cdef Py_ssize_t follow, k
    if 0xC2 <= lead <= 0xDF:
        follow = 1
    elif 0xE0 <= lead <= 0xEF:
        follow = 2
        if lead == 0xE0:
            low = 0xA0
        elif lead == 0xED:
            high = 0x9F  # no surrogates
    elif 0xF0 <= lead <= 0xF4:
        follow = 3
        if lead == 0xF0:
            low = 0x90
        elif lead == 0xF4:
            high = 0x8F  # nothing past U+10FFFF
    else:
        return _defect(s, _JSON_BAD_UTF8, at)
    if at + follow >= s.size or not low <= data[at + 1] <= high:
        return _defect(s, _JSON_BAD_UTF8, at)
    for k in range(2, follow + 1):
        if not 0x80 <= data[at + k] <= 0xBF:
            return _defect(s, _JSON_BAD_UTF8, at)
    return at + follow + 1


cdef Py_ssize_t _escape(_Scanner* s, Py_ssize_t at) noexcept nogil:
    """Read the escape at ``at`` (a backslash); return the offset past it."""
    cdef const unsigned char* data = s.data
    cdef unsigned char kind
    cdef int code
    if at + 1 == s.size:
        return _defect(s, _JSON_TRUNCATED, at + 1)
    kind = data[at + 1]
    if (
        kind == 34 or kind == 92 or kind == 47 or kind == 98 or kind == 102
        or kind == 110 or kind == 114 or kind == 116
    ):
        return at + 2
    if kind != 117:  # u
        return _defect(s, _JSON_BAD_ESCAPE, at)
    code = _hex4(s, at)
    if code < 0:
        return -1
    if 0xDC00 <= code <= 0xDFFF:
        return _defect(s, _JSON_LONE_SURROGATE, at)
    if code < 0xD800 or code > 0xDBFF:
        return at + 6
    # A high surrogate: only a low one may follow, as \uDC00-\uDFFF.
    if at + 6 == s.size:
        return _defect(s, _JSON_TRUNCATED, s.size)
    if data[at + 6] != 92:
        return _defect(s, _JSON_LONE_SURROGATE, at)
    if at + 7 == s.size:
        return _defect(s, _JSON_TRUNCATED, s.size)
    if data[at + 7] != 117:
        return _defect(s, _JSON_LONE_SURROGATE, at)
    code = _hex4(s, at + 6)
    if code < 0:
        return -1
    if not 0xDC00 <= code <= 0xDFFF:
        return _defect(s, _JSON_LONE_SURROGATE, at)
    return at + 12


cdef int _hex4(_Scanner* s, Py_ssize_t at) noexcept nogil:
    """The value of the \\uXXXX escape at ``at``, or -1 for a defect."""
    cdef Py_ssize_t digit
    cdef int value = 0
    cdef int nibble
    for digit in range(at + 2, at + 6):
        if digit == s.size:
            return <int>_defect(s, _JSON_TRUNCATED, digit)
        nibble = _hex_value(s.data[digit])
        if nibble < 0:
            return <int>_defect(s, _JSON_BAD_ESCAPE, at)
        value = value * 16 + nibble
    return value
