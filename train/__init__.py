"""draftsmith.train"""
