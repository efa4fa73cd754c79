"""observe: what chooses each round's block and tree sizes from the acceptance seen so far, and what prices them.

block_size.py     fixed or adaptive block sizes (`drafter.block_size_policy`)
confidence.py     the "confidence" policy: verify the prefix of the drafts the drafter is confident in
tree_size.py      drafter-tree sizes (`drafter.draft_tree`: fixed, or "auto" by expected tokens per second)
hybrid_budget.py  how many drafts the DFlash block and the n-gram continuation each offer (hybrid drafting)
cost_model.py     seconds of one round per block length and rows, interpolated from measured points
cost_timing.py    measuring those points with the real models, once per machine, cached as JSON
"""
