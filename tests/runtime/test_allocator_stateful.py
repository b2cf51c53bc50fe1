"""Long random add/extend/free/prefix-hit sequences against a simple model of the allocator."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dsacache.runtime import OutOfRowsError, RowAllocator

BS = 64
NUM_ROWS = 24
STATE_ROWS = 2
# A few shared prompt prefixes; requests pick one and append their own tail.
PREFIXES = [[1000 * p + i for i in range(3 * BS)] for p in range(3)]


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.alloc = RowAllocator(NUM_ROWS, BS, STATE_ROWS, max_num_pages_per_request=64)
        self.tokens: dict[int, int] = {}  # the model: request -> token count
        self.next_id = 0
        self.next_token = 10**6

    def _fresh(self, n):
        self.next_token += n
        return list(range(self.next_token - n, self.next_token))

    def _expect_add(self, prompt):
        rid, before = self.next_id, self.alloc.num_free_rows
        self.next_id += 1
        if not self.alloc.can_add(prompt):
            try:
                self.alloc.add(rid, prompt)
            except OutOfRowsError:
                assert self.alloc.num_free_rows == before and not self.alloc.has_request(rid)
                return
            raise AssertionError("add succeeded although can_add said no")
        hit = self.alloc.add(rid, prompt)
        assert hit % BS == 0 and hit < max(len(prompt), 1)
        self.tokens[rid] = len(prompt)

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), shared=st.integers(0, 3 * BS), tail=st.integers(0, 150))
    def add_with_prefix(self, prefix, shared, tail):
        self._expect_add(PREFIXES[prefix][:shared] + self._fresh(tail))

    @rule(n=st.integers(0, 300))
    def add_unique(self, n):
        self._expect_add(self._fresh(n))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(0, 130), with_ids=st.booleans())
    def extend(self, data, n, with_ids):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        rows_before = self.alloc.attention_rows(rid)
        ok = self.alloc.can_extend(rid, n)
        try:
            self.alloc.extend(rid, n, self._fresh(n) if with_ids else None)
        except OutOfRowsError:
            assert not ok and self.alloc.attention_rows(rid) == rows_before
            return
        assert ok
        assert self.alloc.attention_rows(rid)[: len(rows_before)] == rows_before
        self.tokens[rid] += n

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.alloc.free(rid)
        del self.tokens[rid]

    @invariant()
    def rows_are_consistent(self):
        self.alloc.check_invariants()
        for rid, n in self.tokens.items():
            assert self.alloc.num_tokens(rid) == n
            assert len(self.alloc.kernel_pages(rid)) == -(-n // 64)
        owned = [r for rid in self.tokens for r in self.alloc.state_rows(rid)]
        assert len(owned) == len(set(owned)) == STATE_ROWS * len(self.tokens)

    def teardown(self):
        for rid in list(self.tokens):
            self.alloc.free(rid)
        self.alloc.check_invariants()
        assert self.alloc.num_free_rows == NUM_ROWS and self.alloc.num_requests == 0


AllocatorMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=100, deadline=None, derandomize=False
)
TestAllocatorMachine = AllocatorMachine.TestCase
