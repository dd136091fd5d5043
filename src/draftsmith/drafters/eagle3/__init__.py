"""draftsmith.drafters.eagle3"""
