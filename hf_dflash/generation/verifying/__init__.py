"""verify and accept: ONE target forward over [unread tokens, drafts], and what the target decides.

target_forward.py     the verification forward on the call's execution path (eager, or compiled at one width)
compiling.py          when `generate` compiles (a `StaticCache`, `compile_config`) and its static cache size
tree_verification.py  a draft tree's attention mask, and the longest path the target accepts through it
acceptance_rules.py   pure functions: logits processing, greedy acceptance, speculative (rejection) sampling
verdict.py            the tokens each row commits this round (greedy acceptance or rejection sampling)
"""
