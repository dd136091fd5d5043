"""Drafters behind one interface (``base.Proposer``): n-gram prompt lookup, a draft LM, EAGLE-3."""
from .base import Proposal, Proposer
from .draft_model import DraftModelProposer, check_same_tokenizer
from .ngram import NgramProposer

__all__ = ["Proposal", "Proposer", "NgramProposer", "DraftModelProposer", "check_same_tokenizer"]
