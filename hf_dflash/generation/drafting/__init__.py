"""propose: where each round's drafts come from.

    strategies/       one file per drafting mode, behind one interface the loop calls (`strategies/base.py`);
                      `drafting_strategy` (`strategies/__init__.py`) chooses one per `generate` call:
                      chains (`chain.py`), drafter trees (`drafter_tree.py`), hybrid drafting (`hybrid.py`)
    block_drafter.py  the drafter pass: one block of drafts for every row, and the drafter's context cache
    selector.py       DFlash2's candidate selector over one drafter pass
    ngram.py          the n-gram (prompt-lookup) source of hybrid drafting
    draft_tree.py     what a draft tree is and how one is built (merging branches, best-first trees)
    proposal.py       what a strategy hands the loop: the drafts and the tree they form

How large a block or tree to draft is chosen in `policies/`; how the target verifies it, in `verifying/`.
"""
