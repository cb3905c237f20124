"""netquant.cli"""
