"""draftsmith.drafters.ngram"""
