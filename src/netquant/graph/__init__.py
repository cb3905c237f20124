"""netquant.graph"""
