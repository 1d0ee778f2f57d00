"""attnlab.models"""
