"""attnlab.text"""
