"""draftsmith.heads"""
